"""Live elastic training (`--nnodes MIN:MAX`): a run that goes on without a restart when a worker fails,
leaves or joins. One package, in the order a change of the group goes through it:

    membership    who is in the run: generations of members over node 0's store, heartbeats, who left
    node          one node's launcher: its workers started and watched, a failed one replaced
    generations   a worker's loop: form a generation, heal, train it, let it go, form the next
    generation    training's hook points (training/generation.py) answered for one generation
    snapshot      a rank's state held in memory across a change, healed from a peer, merged for a new world
    transfer      a state sent from one rank to the others over the group
    connections   the sockets a generation opened: cut when it ends, watched while it trains

Training knows nothing of it beyond its hook points; the other elasticity, a restart of every worker from
the newest checkpoint, is launch/restart.py's.
"""
