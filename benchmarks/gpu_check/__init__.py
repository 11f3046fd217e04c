"""The GPU check: everything a lent GPU should run, in one call of at most seven minutes.

    python -m benchmarks.gpu_check --out DIR            # on a CUDA machine
    python -m benchmarks.gpu_check --out DIR --dry-run  # on CPU: tiny shapes, Triton's interpreter

It records the environment, then runs each step of ``steps.plan`` in its own process with
its own time limit (cut to what is left of the whole run's budget): a step that fails or runs
out of time is recorded and the next one still runs. Everything measured lands under DIR as
JSON (``gpu_check.json``: the environment and every step's status and results) beside the
whole log (``gpu_check.log``). The dry run is the same code on shapes a CPU runs in seconds;
the test suite runs it, so the script cannot rot between GPU loans.
"""
