"""Run a page's python blocks in order in this one process, each in a fresh namespace.

``python run_python_blocks.py BLOCKS.json``: a list of ``{"path", "line", "code"}``. Each block is
compiled with the Markdown file as its file name and its own line numbers, so a traceback points
at the line of the page. The first failure ends the run with status 1.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def main() -> int:
    with open(sys.argv[1]) as f:
        todo = json.load(f)
    for block in todo:
        where = f"{block['path']}:{block['line']}"
        print(f"--- {where}", flush=True)
        start = time.perf_counter()
        # Pad so that line N of the page is line N of the compiled code.
        code = compile("\n" * block["line"] + block["code"], block["path"], "exec")
        try:
            exec(code, {"__name__": "__main__", "__file__": block["path"]})
        except BaseException:  # SystemExit too: a doc block must not end the run early
            traceback.print_exc()
            print(f"--- FAILED: the python block at {where}", flush=True)
            return 1
        print(f"--- ok {where} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
