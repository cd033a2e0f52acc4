"""Offline data preparation (`tenx data prepare`): sources, cleaning, deduplication, the pipeline, its
streaming passes and engines, and decontamination in hash partitions. Training never imports this room;
it reads what it wrote through tenx.data.manifest and tenx.data.loader."""
