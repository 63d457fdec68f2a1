"""A model's weights moved into slabs (spectral/mem/weights.py): the same values, shapes and
sharing after as before, every holder reading the slab, and the slab on huge pages."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from spectral.layers.linear import PackedRows, PackedWeight, weight_tensors
from spectral.mem.weights import gather

HUGE_PAGES = "/sys/kernel/mm/transparent_hugepage/enabled"


class Toy(nn.Module):
    """Small weights as a model holds them: layers, a tied pair, a packed weight in parts and
    a strided view, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        base = torch.randn(6, 16)
        self.packed = PackedRows([PackedWeight(base[:2], 2), PackedWeight(base[2:, ::2], 4)])
        self.register_buffer("table", torch.arange(40.0).reshape(10, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in weight_tensors(module, buffers=True)}


def test_gathered_weights_hold_the_same_values_shapes_and_ties_in_one_slab():
    model = Toy()
    ids = torch.tensor([[1, 7, 49]])
    before = [(t.clone(), t.shape, t.stride()) for t in weight_tensors(model, buffers=True)]
    logits = model(ids)
    assert len(storages(model)) == 9  # 3 x 2 layers, the tied pair, the packed base, buffer

    moved = gather(weight_tensors(model, buffers=True))

    assert storages(model) == {model.table.untyped_storage().data_ptr()}  # one slab
    assert moved == sum(4 * n for n in (50 * 8, 3 * (64 + 8), 6 * 16, 40))
    for (value, shape, stride), t in zip(before, weight_tensors(model, buffers=True)):
        assert t.shape == shape and t.stride() == stride and torch.equal(t, value)
    assert model.head.weight is model.embed.weight
    parts = model.packed.parts
    assert parts[1].data.data_ptr() - parts[0].data.data_ptr() == 2 * 16 * 4  # still one base
    assert torch.equal(model(ids), logits)
    assert gather(weight_tensors(model, buffers=True)) == 0  # in a slab already


def test_a_tensor_not_given_keeps_its_storage_and_values():
    weight = torch.randn(4, 4)
    view = weight[1]  # shares the storage, not handed to gather
    expected = view.clone()
    gather([weight])
    assert view.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    assert torch.equal(view, expected) and torch.equal(weight[1], expected)


PROBE = """
import spectral, torch
from torch import nn
from spectral.layers.linear import weight_tensors
from spectral.mem.weights import gather

def mapping(tensor):
    # (AnonHugePages KiB, THPeligible, asked for huge pages) of the mapping holding tensor
    address = tensor.untyped_storage().data_ptr()
    inside, huge, eligible, asked = False, 0, 0, 0
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
        elif inside and head == "THPeligible:":
            eligible = int(line.split()[1])
        elif inside and head == "VmFlags:":
            asked = int("hg" in line.split()[1:])
    return huge, eligible, asked

def fallbacks():
    for line in open("/proc/vmstat"):
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0

model = nn.Sequential(*(nn.Linear(128, 128) for _ in range(256)))  # 256 x 64 KiB weights
with torch.no_grad():
    for p in model.parameters():
        p.add_(1)  # touched
before = sum(mapping(layer.weight)[0] for layer in list(model)[::32])
failed = fallbacks()
gather(weight_tensors(model))
print(before, *mapping(model[0].weight), fallbacks() - failed)
"""


@pytest.mark.skipif(
    "[never]" in open(HUGE_PAGES).read() if __import__("os").path.exists(HUGE_PAGES) else True,
    reason="this kernel has no transparent huge pages",
)
def test_small_weights_gathered_land_on_huge_pages():
    """Weights of 64 KiB sit on 4 KiB pages as PyTorch allocates them; their slab (16 MiB) is
    asked for huge pages (MADV_HUGEPAGE) and lands on them (a process that imports spectral
    first, as a server does), unless the kernel found no free huge page just then (its
    fallback count moved: a machine's fragmented memory, not the slab's doing)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    before, huge, eligible, asked, fallbacks = (int(x) for x in out[-5:])
    assert before == 0
    assert eligible == 1 and asked == 1
    assert huge >= 12 << 10 or fallbacks > 0


def test_a_freed_slab_is_forgotten_so_what_lands_where_it_was_is_gathered():
    from spectral.mem import weights

    weight = torch.randn(256, 256)
    gather([weight])
    inside = weight.data_ptr()
    assert weights._in_slab(inside)
    del weight  # the model freed: its slab with it
    assert not weights._in_slab(inside)


def test_each_old_storage_is_freed_once_its_holders_are_rebound(monkeypatch):
    """A load's peak is its weights and one slab: a storage moved is not kept to the end."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from spectral.mem import weights

    monkeypatch.setattr(weights, "SLAB_BYTES", 4096)
    tensors = [torch.randn(1024) for _ in range(4)]  # 4 KiB each: a slab apiece
    refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
    alive_at_fill = []
    fill = weights._fill

    def counting(batch, size):
        alive_at_fill.append(sum(not ref.expired() for ref in refs))
        fill(batch, size)

    monkeypatch.setattr(weights, "_fill", counting)
    weights.gather(tensors)
    assert alive_at_fill == [4, 3, 2, 1]
