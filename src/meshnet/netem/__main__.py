"""``python -m meshnet.netem CONFIG.json``: the link emulator as a process (see meshnet.netem.control)."""

import json
import sys

from meshnet.netem.control import serve

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m meshnet.netem CONFIG.json")
    with open(sys.argv[1]) as f:
        serve(json.load(f))
