"""Vision-language models (issue 39): LLaVA-1.5 (CLIP ViT + MLP projector + our Llama) and
Idefics3 / SmolVLM (SigLIP + pixel-shuffle connector + our Llama). Notes, parity figures and
what is refused: docs/vision.md.

The submodules sit at different layers of the import contract (pyproject.toml), so this package
imports none of them:
  * `config`, `idefics3_config`: the families' configs from a HF `config.json`;
  * `preprocess`, `idefics3_preprocess`: the `transformers` image processors (resize / crop /
    image splitting / rescale / normalise) in Pillow + numpy;
  * `prompts`: a prompt's image-token layout per family (`expand_prompt`);
  * `clip`, `siglip`: the vision towers with their projector / connector;
  * `tower_lora`: LoRA on a tower's linears, each image (tile) its own adapter;
  * `adapters`: PEFT adapters saved on a VLM (language model; tower by `load_vlm_lora`);
  * `llava`, `idefics3`: the models (tower + the Llama language model);
  * `loading`, `idefics3_loading`: `load_vlm` from a HF directory (dispatch on model_type);
  * `generate`: generation with images in the prompt.
"""
