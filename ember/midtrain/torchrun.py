"""torchrun for Slurm jobs: the per-node agent ignores SIGUSR1, its workers handle it.

Why: torchrun turns a handled signal into a shutdown that SIGKILLs the workers 30 s later, which
would cut a large checkpoint short. Slurm delivers a step's signals to every process of the step,
so the trainers receive the batch shell's USR1 directly, checkpoint for as long as it takes and
exit 0, and torchrun then exits 0 as for any finished run. Workers inherit the ignored USR1 until
`ember.midtrain.train` installs its handler, so an early signal is never fatal.
"""

import signal
import sys

from torch.distributed.run import main

if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    sys.exit(main())
