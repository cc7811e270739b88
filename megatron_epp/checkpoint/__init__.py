"""Checkpoints: what a checkpoint records (:mod:`.records`), save and load (:mod:`.store`), every file's checksum
verified before a load with a fallback to an older checkpoint (:mod:`.integrity`), resharding to another layout
(:mod:`.reshard`), and the Hugging Face LLaMA import and export (:mod:`.hf_convert`, :mod:`.hf_llama`)."""
