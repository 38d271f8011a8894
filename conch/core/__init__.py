"""Every decision of conch's protocol, without I/O: no sockets, no threads, no clock.

``messages``: what the machines and drivers say to each other (inputs, actions, outcomes).
``waiter``: one acquire of one semaphore, as a state machine (inputs in, actions out).
``guard``: a held slot's guard (when to touch, when to watch, what a notice means).

The faces (``conch.semaphore`` / ``conch.hold`` / ``conch.session`` on threads, ``conch.aio``
on the loop) execute what these decide; they decide nothing themselves.
"""
