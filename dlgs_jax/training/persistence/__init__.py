"""What keeps a run alive across stops: checkpoints, resuming, resharding, its workdir.

`checkpoint` saves and verifies the whole state with orbax, `resume` restores it
(converting older layouts and other worker counts through `reshard`), `workdir`
keeps two runs out of one directory, and `preemption` turns a SIGTERM into a
last checkpoint.
"""
