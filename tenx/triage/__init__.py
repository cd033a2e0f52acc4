"""Triage: every anomaly of a run becomes an incident, is replayed, bisected and given a root cause.

- `store`: the incident store (RUN_DIR/incidents.db, SQLite), fed from events.jsonl (`tenx incidents`).
- `replay`: rebuild the state before a step and run it again, bit for bit (`tenx replay`).
- `bisect`: run a step on the path it was trained on and check every operator against float64; name the
  first that is wrong, and the data that makes it wrong.
- `classify`: a verdict per incident with its evidence, and the root causes behind them (`tenx triage`).
"""
