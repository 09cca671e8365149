"""`dynatrain selfcheck --module hf_selfcheck:HFModule` (or `:AutoModule`): the stock Hugging Face Llama of
hf_data.py on its own shuffled map-style DataLoader, built with no arguments."""

from hf_data import AutoLM, HFLM


class HFModule(HFLM):
    def __init__(self) -> None:
        super().__init__(data="map", samples=96, batch_size=2, shuffle=True, workers=0)


class AutoModule(AutoLM):
    """The same Llama with tied embeddings and no configure_model(): the strategy parallelises it by default."""

    def __init__(self) -> None:
        super().__init__(data="map", samples=96, batch_size=2, shuffle=True, workers=0, model="llama-tied")
