"""The engine loop and its scheduling: ``LLMEngine`` (schedule, execute, update), the scheduler
(the one writer of request state), the waiting queues, admission, the prefill chunk budget, the
``Request`` and a step's plan and result, detokenizing and the start-up timings."""
