"""Layer 3: the job control plane without Celery.

Submission and intake, lifecycle, finalisation, output files, recovery.
"""
