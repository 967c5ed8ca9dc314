"""The benchmark: `python -m benchmarks` (or `make bench`) prints the machine it runs
on, then each goal row of the project's performance with its measured value and
whether the goal is met. It measures, and never tests; `--smoke` runs every row at
tiny sizes in a few seconds, to check that they run (tests/test_bench.py does).

    harness.py    the settings, the machine, the one timing harness, the rows
    training.py   the training step against torch.nn.Transformer; FLOP utilisation
    decoding.py   greedy decoding against its bound; beam search against greedy
    __main__.py   the command line

Every row is a ratio of times taken in the same run on the same machine, the two
sides alternated round by round (machines are shared and their speed drifts), with
the book's own classes: a model from make_model is the one every run trains.
"""
