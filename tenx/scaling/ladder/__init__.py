"""Ladders: a family of small runs at increasing compute, the evidence every fit and derisk study reads.

Modules, each importing only those listed after it: run (training a ladder's runs in this process, in
workers or as cluster scripts; results.jsonl), scripts (torchrun and Slurm scripts of a planned ladder),
estimate (what a ladder will cost before it runs), rungs (a ladder's runs from compute budgets).
"""
