"""The `a3b` command with the fake engine registered: `python tests/fakeserver.py lsp --stdio --model fake://x`.

Language server tests of the fast tier start this instead of `python -m comfyui_a3b.cli`, so the
server process is the real one and only the model behind the engine seam is fake.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fakeengine

fakeengine.install()

from comfyui_a3b.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
