"""conch: flock(1) for a whole cluster, on etcd v3.

    conch sema NAME --max N -- CMD...

runs CMD only while holding one of N slots of the semaphore NAME, counted across every machine
that talks to the same etcd cluster, and kills CMD the moment the hold is lost.
"""

__version__ = "0.1.0"
