"""What every room uses to talk across ranks: collectives started asynchronously and waited with a bound
(comm.py: gloo's reduce-scatter as a point-to-point exchange), bounded waits that name the rank, the peer and
the operation (waits.py), the ranks' agreement that raises one rank's error on all (fail_together.py), and what
l3plugin left running, finished at the interpreter's exit (at_exit.py)."""
