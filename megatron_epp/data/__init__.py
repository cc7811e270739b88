"""Data layer: tokenizers (:mod:`.tokenizers`), indexed-dataset preparation (:mod:`.prepare`), conversations rendered
with a chat template and the loss masks of the assistant's tokens (:mod:`.conversations`), documents
(:mod:`.documents`), fixed-length GPT samples (:mod:`.gpt_samples`), ``--data-path`` blends (:mod:`.data_path`,
:mod:`.blend`), the elastic whole-document sampler (:mod:`.sequence_sampler`) and lengths files (:mod:`.lengths`, numpy
only: the planner reads them). Data imports no other package of the library: the sampler is given the planner's
data-parallel split by training.

Import the module you need: this package imports nothing itself, so the light modules (the ``--data-path``
parser, the tokenizers) load without torch's data utilities and megatron-core, and a bad flag is answered
before those are imported.
"""
