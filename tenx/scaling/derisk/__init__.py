"""Derisking: add changes to a known-good config one at a time and check that each gain persists with scale.

Modules: compute_multiplier (the effective compute multiplier of each change of a stack, per budget:
`tenx derisk`), data_multiplier (the effective data multiplier at a fixed budget of unique tokens:
`mode = "data"`), study (the driver
both share: train the planned runs, reusing what OUT holds, analyse, write the report).
"""
