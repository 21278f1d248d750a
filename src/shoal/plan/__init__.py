"""`shoal plan`: which layouts of a config are valid, what each one costs per rank in memory and step
time, and how far a finished run was from that prediction. Pure Python over the model built on the
meta device (shapes only): no process group, no weights.

    enumerate.py   every (dp, tp, pp, schedule, ZeRO, checkpointing, micro-batch), valid or why not
    cost.py        one micro-batch's operators (FLOPs, bytes) and saved activations, traced on meta
    predict.py     per-rank memory and step time of one layout, from the cost and a hardware profile
    check.py       a finished run's summary.json against the prediction for its layout
"""
