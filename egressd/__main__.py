import os
import sys

# `python -m egressd` puts the working directory first on sys.path. A module egressd imports later
# (an addon, on the first SOCKS5 connection) must never come from there: a sandboxed child may write
# in that directory.
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from egressd.entry import main  # noqa: E402 - after the sys.path fix above

main()
