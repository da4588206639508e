"""``ModelSpec``: a model by name and overrides, importable without torch.

Plan files and the trace cache name models by their spec alone; building the module (and
importing torch) waits until :func:`planlab.models.registry.build_model` is called.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from planlab.errors import ConfigError, choices
from planlab.inputs import model_arg, model_arg_type

if TYPE_CHECKING:
    from planlab.models.families import Family, ModelConfig


def is_user_model(name: str) -> bool:
    """True for ``package.module:function`` names."""
    return ":" in name


@dataclass(frozen=True)
class ModelSpec:
    """A model by name (a preset, a family, or ``package.module:function``) with keyword overrides."""

    name: str
    args: tuple[tuple[str, int | float], ...] = ()

    def family(self) -> Family | None:
        """The built-in family this spec names (None for a user's model); ConfigError if unknown."""
        from planlab.models.families import FAMILIES, PRESET_FAMILY

        if is_user_model(self.name):
            return None
        if self.name in PRESET_FAMILY:
            return FAMILIES[PRESET_FAMILY[self.name]]
        if self.name in FAMILIES:
            return FAMILIES[self.name]
        raise ConfigError(
            f"unknown model {self.name!r}; choose {choices(list(PRESET_FAMILY) + list(FAMILIES))}, "
            "or package.module:function for your own model"
        )

    def config(self) -> ModelConfig:
        """The family config this spec names; ConfigError on an unknown name or key."""
        fam = self.family()
        if fam is None:
            from planlab.models.user import user_model_config

            return user_model_config(self.name, self.args)
        fields = fam.config.__dataclass_fields__
        kw = dict(self.args)
        proto = fam.presets.get(self.name) or next(iter(fam.presets.values()))
        for k, v in kw.items():
            if k not in fields:
                raise ConfigError(f"unknown model argument {k!r} for {self.name!r}; choose {choices(list(fields))}")
            model_arg_type(k, v, getattr(proto, k))  # before the family's checks compute with it
        if self.name in fam.presets:
            cfg = replace(fam.presets[self.name], **kw)
        else:
            missing = [f for f in fam.required if f not in kw]
            if missing:
                raise ConfigError(f"model family {self.name!r} needs --model-arg for {', '.join(missing)}")
            cfg = fam.config(**kw)
        fam.check(cfg)
        for k, v in kw.items():  # the family's checks first (their messages are more precise), then planlab's limits
            model_arg(k, v, getattr(proto, k))
        return cfg

    def to_json(self) -> dict:
        return {"name": self.name, "args": dict(self.args)}

    @classmethod
    def from_json(cls, d: dict) -> "ModelSpec":
        return cls(str(d["name"]), tuple(sorted(dict(d.get("args", {})).items())))

    def __str__(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.args)
        return self.name + (f"({extra})" if extra else "")
