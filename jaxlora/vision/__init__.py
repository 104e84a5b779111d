"""Vision-language models (issue 39): LLaVA-1.5 first (CLIP ViT + MLP projector + our Llama).
Notes, parity figures and what serving needs next: docs/vision.md.

The submodules sit at different layers of the import contract (pyproject.toml), so this package
imports none of them:
  * `config`: `ClipVisionConfig`, `LlavaConfig` from a HF `config.json`;
  * `preprocess`: the `transformers` image processor's resize / center crop / rescale / normalise
    in Pillow + numpy, and the prompt's image-token layout;
  * `clip`: the CLIP vision tower and the multimodal projector (`VisionTower`);
  * `tower_lora`: LoRA on the tower's linears, each image its own adapter;
  * `adapters`: PEFT adapters saved on a LLaVA model (language model; tower by `load_llava_lora`);
  * `llava`: `Llava`, the tower + projector + the Llama language model;
  * `loading`: `load_llava` / `load_vlm` from a HF directory;
  * `generate`: generation with images in the prompt.
"""
