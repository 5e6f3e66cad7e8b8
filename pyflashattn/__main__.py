"""``python -m pyflashattn``: versions, driver, GPUs and cubins of this installation (see
pyflashattn/_runtime/info.py); quick and correct on a machine without a GPU."""
import sys

from . import __version__
from ._runtime.info import main

if __name__ == "__main__":
    sys.exit(main(__version__))
