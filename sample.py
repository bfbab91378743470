"""Continue prompts with a text run of train.py: ``python sample.py RUN_DIR --prompt TEXT``.

The command of ``python -m training.sample``, runnable from any folder as
``python /path/to/checkout/sample.py``: Python puts a script's own folder (the
checkout) first on ``sys.path``, so ``training`` is found there without
installing the application (export.py says why it is not installed). ``--help``
lists the flags.
"""

import sys

if __name__ == '__main__':
  from training.sample import main
  sys.exit(main(prog='sample.py'))
