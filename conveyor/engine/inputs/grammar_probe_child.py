"""The grammar probe's child process (run by path: it imports llguidance and nothing of ours).

stdin: one JSON line with the tokenizer (``{"tokenizer": <tokenizer.json text>, "n_vocab",
"eos"}``), then one JSON line per grammar (``{"grammar": <llguidance grammar>}``). stdout: one
JSON line per grammar, ``{"error": null}`` or ``{"error": "<the library's first message>"}``.
A compile that runs past its budget is ended by the parent killing this process.
"""

import json
import sys


def main() -> None:
    import llguidance

    header = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(header["tokenizer"], n_vocab=header["n_vocab"], eos_token=header["eos"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        grammar = json.loads(line)["grammar"]
        try:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
            error = messages[0] if is_error else None
        except Exception as exc:  # any failure is this grammar's, told to the parent
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"error": error}), flush=True)


if __name__ == "__main__":
    main()
