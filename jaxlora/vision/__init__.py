"""Vision-language models (issue 39): LLaVA-1.5 first (CLIP ViT + MLP projector + our Llama).

The submodules sit at different layers of the import contract (pyproject.toml), so this package
imports none of them:
  * `config`: `ClipVisionConfig`, `LlavaConfig` from a HF `config.json`;
  * `preprocess`: the `transformers` image processor's resize / center crop / rescale / normalise
    in Pillow + numpy, and the prompt's image-token layout;
  * `clip`: the CLIP vision tower and the multimodal projector (`VisionTower`);
  * `llava`: `Llava`, the tower + projector + the Llama language model;
  * `adapters`: PEFT adapters saved on a LLaVA model, mapped onto the language model;
  * `loading`: `load_llava` / `load_vlm` from a HF directory;
  * `generate`: greedy / sampled generation with images in the prompt.
"""
