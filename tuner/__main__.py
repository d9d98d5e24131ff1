import sys

from dietserve.host.startup import keep_torch_out

if __name__ == "__main__":
    keep_torch_out()  # before the tuner imports TVM
    from .cli import main

    sys.exit(main())
