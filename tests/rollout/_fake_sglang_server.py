"""A FakeSGLang server in a process of its own, for tests that kill it: prints its URL, then serves until it is
killed. ``python _fake_sglang_server.py [STEP_SECONDS]`` (this folder is the script's first ``sys.path`` entry)."""

import sys
import threading

from fake_sglang import FakeSGLang

if __name__ == "__main__":
    with FakeSGLang(step_s=float(sys.argv[1]) if len(sys.argv) > 1 else 0.002) as fake:
        print(fake.url, flush=True)
        threading.Event().wait()
