"""The model on megatron-core: the process's runtime (process groups, device, seeds: :mod:`.runtime`) and the GPT
built on it with its layer specs (:mod:`.gpt`), the stock ones or the elastic executor's."""
