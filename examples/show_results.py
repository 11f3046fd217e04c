"""Print a results file's answers, one line per choice: what `make run` shows at the end."""

import json
import sys

with open(sys.argv[1], encoding="utf-8") as results:
    for line in results:
        result = json.loads(line)
        for choice in result["response"]["body"]["choices"]:
            message = choice.get("message") or {}
            print(f"{result['custom_id']}: {message.get('content', choice.get('text'))!r}")
