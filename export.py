"""Write a train.py run as a Hugging Face folder: ``python export.py RUN_DIR OUT_DIR``.

The command of ``python -m training.export``, runnable from any folder as
``python /path/to/checkout/export.py``: Python puts a script's own folder (the
checkout) first on ``sys.path``, so ``training`` is found there. pyproject.toml
installs the library alone, so that the application's packages never claim
names such as ``models`` in a user's site-packages; these scripts are how the
application runs from elsewhere. ``--help`` lists the flags.
"""

import sys

if __name__ == '__main__':
  from training.export import main
  sys.exit(main(prog='export.py'))
