"""Train a GPT-2-style model with a named remat policy: ``python train.py --remat=sqrt``.

``python train.py --help`` lists the flags, ``--remat=list`` the policies.
"""

import os
import signal
import sys


def _interrupted_while_loading(signum, frame):
  # Ctrl-C while the libraries load (seconds): nothing is written yet, so exit at once. A
  # KeyboardInterrupt raised inside an import is turned into other errors by some libraries
  # (numpy: "ImportError: numpy._core.multiarray failed to import", 40 lines).
  del signum, frame
  sys.stderr.write('train.py: interrupted\n')
  sys.stderr.flush()
  os._exit(130)


if __name__ == '__main__':
  signal.signal(signal.SIGINT, _interrupted_while_loading)
  from training.cli import main
  signal.signal(signal.SIGINT, signal.default_int_handler)
  sys.exit(main())
