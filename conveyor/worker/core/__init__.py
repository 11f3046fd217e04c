"""Layer 0: configuration.

``CONVEYOR_*`` settings, input limits, and the background-thread helper every layer may use.
"""
