"""Layer 2: pure input/output formats.

Input readers (JSONL, CSV, Parquet), request-body validation, output lines.
"""
