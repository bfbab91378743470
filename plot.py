"""Draw a train.py run's losses, metrics and learning rate: ``python plot.py RUN_DIR``.

The command of ``python -m training.plot``, runnable from any folder as
``python /path/to/checkout/plot.py`` (see export.py for why these scripts exist).
"""

import sys

if __name__ == '__main__':
  from training.plot import main
  sys.exit(main(prog='plot.py'))
