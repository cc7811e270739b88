"""The tags an option field carries (:func:`~megatron_epp.base.options.option`'s ``tags``): what reads the field
besides the parser, each tag's fields found by :func:`~megatron_epp.base.options.fields_tagged` (in declaration
order) or :func:`~megatron_epp.base.options.tag_values` (with the tag's value), so that no list elsewhere retypes
their names. In one module because the planner's options (``planner.config``) carry some of them too."""

from __future__ import annotations

# pretrain_gpt.py: an --epp-* option that applies only with --elastic-pp or --epp-search-layout (an error without both)
ELASTIC_ONLY = "elastic only"
# pretrain_gpt.py: an --epp-* option that --epp-search-layout cannot honour; the value: why (after "does not apply with
# --epp-search-layout (...)")
REFUSED_BY_SEARCH = "refused by the layout search"

# A checkpoint's epp_metadata.json: the model's shape, recorded at save and compared on --load; the value: the key's
# place in the record ("model"), which keeps its order as keys are added (a new key takes the next place)
MODEL_SHAPE = "checkpoint model shape"
# what --finetune (the model's weights only) may change in the recorded model shape: the context, RoPE's base and scaling
FINETUNE_FREE = "free under --finetune"
# RoPE's scaling (megatron-core's llama3 rope_scaling, or linear interpolation): compared on a resume, free under --finetune
ROPE_SCALING = "rope scaling"
# a model-shape key compared through the padded vocabulary size it gives at each layout's tensor-parallel size
VOCAB_PADDING = "vocabulary padding"
# what the sample stream is a function of, besides the blend and its position; the value: the key's place in the record
SAMPLER = "sampler"

# REFUSED_BY_SEARCH's reasons
SEARCH_MODELS_THE_PRESET = "it models the --epp-cluster preset's GPUs for the model the flags describe"
SEARCH_DOES_NOT_TRAIN = "it prints a layout and exits without training"
