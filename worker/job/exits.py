"""The job process's exit codes, read by the worker task that started it (:mod:`worker.requeue`).

0 the job reached a terminal state; 75 preempted by SIGTERM (checkpoint written, job left
running for the worker to re-queue, attempt not counted); 69 interrupted: the database was unreachable
for longer than the outage window (checkpoint written if the disk allowed, unwritten reports saved in
the output directory for the next run; the worker re-queues the job, the attempt counted); 74 no space
left while writing a checkpoint, or too little left at the start for one more (the previous one kept;
the worker re-queues the job at once to wait off the GPU, the attempt not counted); 3 the job is not
ours: already claimed elsewhere, or taken away while running (re-queued by the reaper, finished
elsewhere), in which case the process exits at once without writing more (another process may own
the output directory); 64 the job asks for another number of ranks than this group has (not
claimed); 76 a peer rank failed (its collective broke: the job is left running, the group's code is
the failed rank's); any other exit (a crash, a signal) leaves the job running for the worker or the
reaper to re-queue.
"""

from __future__ import annotations

from trainer.run import launch

#: The job reached a terminal state (or, on a peer rank, its run ended).
EXIT_DONE = 0
#: Preempted by SIGTERM: checkpoint written, job left running for the worker to re-queue.
EXIT_PREEMPTED = 75
#: The database stayed unreachable for longer than the outage window (sysexits EX_UNAVAILABLE).
EXIT_DB_UNAVAILABLE = 69
#: The job asks for a different number of ranks than this process group has (sysexits EX_USAGE).
EXIT_WRONG_RANKS = 64
#: Rank 0's collective broke because a peer rank failed (sysexits EX_PROTOCOL); the job is left running.
EXIT_PEER_LOST = launch.EXIT_PEER_LOST  # 76: the launcher never takes it for the group's cause
#: No space left while writing a checkpoint (sysexits EX_IOERR).
EXIT_DISK_FULL = 74
#: The job was taken away while this process ran it (re-queued or finished elsewhere).
EXIT_LOST = 3
