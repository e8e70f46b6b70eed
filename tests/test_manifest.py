import dataclasses

import pytest

from checkpoint.manifest import (
    KeyRecord,
    Manifest,
    NotACheckpointError,
    checksum_file,
    read_manifest,
    verify_files,
    write_manifest,
)


def _committed(tmp_path) -> Manifest:
    (tmp_path / "__0_0.distcp").write_bytes(b"0123456789")
    manifest = Manifest(
        world_size=2,
        keys={"model.w": KeyRecord("tensor", "bfloat16", (4, 3)), "extra.step": KeyRecord("bytes")},
        files={"__0_0.distcp": checksum_file(tmp_path / "__0_0.distcp")},
    )
    write_manifest(tmp_path, manifest)
    return manifest


def test_manifest_round_trips_and_is_byte_deterministic(tmp_path):
    manifest = _committed(tmp_path)
    assert read_manifest(tmp_path) == manifest
    first = (tmp_path / "manifest.json").read_bytes()
    write_manifest(tmp_path, manifest)
    assert (tmp_path / "manifest.json").read_bytes() == first


def test_a_manifest_written_again_after_its_keys_changed_records_the_new_keys(tmp_path):
    manifest = _committed(tmp_path)  # its keys are encoded once and reused while they stay the same
    manifest.keys["model.w"] = KeyRecord("tensor", "float32", (4, 3), identity=7)  # the same dict, changed
    manifest.keys["extra.new"] = KeyRecord("bytes")
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path).keys == manifest.keys
    manifest.keys["model.w"] = KeyRecord("tensor", "float32", (4, 3), identity=1 << 40)  # out of range
    with pytest.raises(ValueError, match="model.w.*identity"):
        write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path).keys["model.w"].identity == 7  # nothing was committed


@pytest.mark.parametrize("value", ['"7"', "-1", str(1 << 32), "true", "1.5"])
def test_a_manifest_pinning_its_key_records_round_trips_and_a_bad_pin_is_refused(tmp_path, value):
    manifest = dataclasses.replace(_committed(tmp_path), keys_from_metadata_crc32=0xFFFFFFFF)
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest
    path = tmp_path / "manifest.json"
    path.write_text(path.read_text().replace(str(0xFFFFFFFF), value))
    with pytest.raises(ValueError, match="keys_from_metadata_crc32 is not a 32-bit unsigned integer"):
        read_manifest(tmp_path)


def test_read_manifest_distinguishes_missing_path_from_uncommitted_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        read_manifest(tmp_path / "nope")
    with pytest.raises(NotACheckpointError, match="manifest.json"):
        read_manifest(tmp_path)


def test_read_manifest_refuses_another_format_version(tmp_path):
    _committed(tmp_path)
    path = tmp_path / "manifest.json"
    path.write_text(path.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(ValueError, match="version 99"):
        read_manifest(tmp_path)


def test_verify_files_names_truncated_corrupt_and_missing_files(tmp_path):
    manifest = _committed(tmp_path)
    assert verify_files(tmp_path, manifest) == []
    data = tmp_path / "__0_0.distcp"
    data.write_bytes(b"0123456788")
    assert "CRC-32" in verify_files(tmp_path, manifest)[0]
    data.write_bytes(b"01234")
    assert "truncated" in verify_files(tmp_path, manifest)[0]
    data.unlink()
    assert "missing" in verify_files(tmp_path, manifest)[0]
