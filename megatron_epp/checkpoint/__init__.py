"""Checkpoints: save and load in Megatron-LM's layout with megatron-core's dist_checkpointing, every file's checksum
verified before a load and a fallback to an older checkpoint, resharding to another layout
(:mod:`.checkpointing`), and the Hugging Face LLaMA import and export (:mod:`.hf_convert`, :mod:`.hf_llama`)."""
