"""Ladders: a family of small runs at increasing compute, the evidence every fit and derisk study reads.

Modules, each importing only those listed after it: runner (training a ladder's runs in this process, in
workers or as cluster scripts; results.jsonl), emit (the torchrun and Slurm scripts of a planned ladder),
cost (what a ladder will cost before it runs), rungs (a ladder's runs from compute budgets).
"""
