"""Kandinsky 6.0 (Lite, Pro): `spec` (flavours, repository ids; no torch), `family` (the adapter: text, latents, the
transformer call, LoRA file, renders), `tiny` (its tiny checkpoint from the real diffusers classes)."""
