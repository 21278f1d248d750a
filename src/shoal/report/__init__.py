"""`shoal report`: one self-contained HTML page of one or more run directories (loss, throughput, where
each step's time goes, memory, bytes sent, stragglers, checkpoints and recoveries), for comparing runs."""
