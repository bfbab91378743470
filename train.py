"""Train a GPT-2-style model with a named remat policy: ``python train.py --remat=sqrt``.

``python train.py --help`` lists the flags, ``--remat=list`` the policies.
"""

import sys

from training.cli import main

if __name__ == '__main__':
  sys.exit(main())
