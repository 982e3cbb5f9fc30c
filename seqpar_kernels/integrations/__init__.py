"""Integrations with other libraries, each an optional dependency imported only by its
own module (seqpar_kernels itself never imports them):

    seqpar_kernels.integrations.transformers   Hugging Face transformers models
                                               (pip install "seqpar-kernels[transformers]")
    seqpar_kernels.integrations.diffusers      diffusers video and image transformers
                                               (pip install "seqpar-kernels[diffusers]")
"""
