"""Choosing each kernel's config on a GPU (a leaf: imports torch, triton and nothing of tilefuse's
above it). ``tables`` reads and writes tuned-config tables; ``autotuner`` is the ``triton.autotune``
every kernel uses, which consults them; ``choices`` picks, the same way, between an op's implementations
(tilefuse's kernels or the vendor's). See ``autotuner``'s module doc for the order of lookups and
how the shipped table is produced."""
from tilefuse.tuning.autotuner import (TableAutotuner, autotune, autotune_enabled, describe,  # noqa: F401
                                       describe_record, stored_configs_used, tune_missing_keys, tuning_record,
                                       use_stored_configs)
from tilefuse.tuning.tables import (TABLE_FORMAT, atomic_write_json, cache_dir, config_from_dict,  # noqa: F401
                                    config_to_dict, gpu_slug, load_shipped_table, load_user_entries, lookup,
                                    make_entry, shipped_table_path, store_user_entry, user_cache_path,
                                    write_table)
from tilefuse.tuning.choices import (TILEFUSE, BackendChoice, ChoiceKey, choice_records,  # noqa: F401
                                     clear_choices)
from tilefuse.tuning.autotuner import tuning_records as _kernel_records


def tuning_records() -> list[dict]:
    """How every autotuned kernel chose its config and every backend choice its candidate, per key, in this
    process (:func:`tuning_record`'s format; a choice's config is ``{"kwargs": {"BACKEND": name}}``)."""
    return _kernel_records() + choice_records()
