"""Held-out photo sets: real photographs that Debian packages ship, cut into ImageFolder trees the way the photos
source is, for checking a recipe feature on data the project was not tuned on (bench/teacher_quality.py
--data-root; docs/recipe.md, "Held-out photo sets").

Each set is one package's photographs (downloaded from the Debian archive at a pinned version by `apt-get
download` and unpacked by `dpkg-deb`: no other source), one class per photograph. `coarse2fine.data.sources.
write_patches` cuts them as it cuts scikit-image's photographs for `data.source: photos`: 60 train and 15 val
patches per class (`data.photos`' defaults), 64 px on the shorter side, the val patches from a block of each photo
that no train patch touches; a fifth of the patches, drawn at random, are written grey (single-channel), as
ImageNet holds some grey photos. Photographs only: drawings, renders and gradients the packages also ship are
left out (each set names what it leaves out).

Run: python bench/photo_sets.py [--sets lomiri mate-nature plasma lxqt kphotoalbum] [--out data/photo_sets]
[--seed 0]. Writes <out>/<set>/{train,val}/<photo>/NNNN.png and <out>/<set>.json (the package, its version, each
photo's sha256). data/photo_sets/ is ignored by git and DVC. --tiny: 2 photos of the first set, 3 + 1 patches each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from coarse2fine.config import PhotosSource
from coarse2fine.data.sources import write_patches

GREY_SHARE = 0.2
Image.MAX_IMAGE_PIXELS = None  # wallpapers of up to 5120 x 2880 (PIL's bomb guard is for untrusted files)


@dataclass(frozen=True)
class PhotoSet:
    package: str  # Debian's package name
    version: str  # pinned: the set is the same wherever it is built
    photos: dict[str, str]  # class name -> the photograph's path in the package
    about: str  # what the photographs are, and what was left out


SETS = {
    "lomiri": PhotoSet(
        "lomiri-wallpapers-16.04", "20.04.0-2",
        {name.split("_by_")[0].lower(): f"usr/share/backgrounds/{name}.jpg" for name in (
            "Bridge_by_Sander_Klootwijk", "Dragonfly_by_Bolly", "Picture_0B_by_freespace", "Picture_1A_by_freespace",
            "Wine_by_Jakkub_Mede", "aitzgorri_by_Aitzol_Berasategi", "analogpattern_by_Peter_Nerlich",
            "free_by_Peter_Nerlich", "friends_by_Aitzol_Berasategi", "greentock_by_Peter_Nerlich",
            "life_by_Aitzol_Berasategi", "picosdeeuropa_by_Aitzol_Berasategi", "seeding_by_Clements_Engelhardt",
            "sunset_by_Aitzol_Berasategi",
        )},
        "Ubuntu Touch's wallpapers (Lomiri), photographs of scenes, objects and animals by their named authors; "
        "left out: umang_by_Abhishek_Mudgal (a synthetic gradient)",
    ),
    "mate-nature": PhotoSet(
        "mate-backgrounds", "1.26.0-1",
        {name.lower(): f"usr/share/backgrounds/mate/nature/{name}.jpg" for name in (
            "Aqua", "Blinds", "Dune", "FreshFlower", "Garden", "GreenMeadow", "LadyBird", "RainDrops", "Storm",
            "TwoWings", "Wood", "YellowFlower",
        )},
        "MATE's nature backgrounds: close-ups of leaves, grass, flowers, water and sky, several alike in colour "
        "(the folders abstract/ and desktop/ are drawings)",
    ),
    # The confirmation set (issue 56): built only once the choice was made on the two above (keep the defaults).
    "plasma": PhotoSet(
        "plasma-workspace-wallpapers", "4:5.27.5-2",
        {name.lower(): f"usr/share/wallpapers/{name}/contents/images/{size}.jpg" for name, size in (
            ("BytheWater", "2560x1440"), ("ColdRipple", "2560x1440"), ("ColorfulCups", "2560x1600"),
            ("DarkestHour", "2560x1440"), ("EveningGlow", "2560x1440"), ("FallenLeaf", "2560x1440"),
            ("Grey", "2560x1440"), ("Kite", "2560x1440"), ("OneStandsOut", "2560x1440"), ("Path", "2560x1440"),
            ("summer_1am", "2560x1440"),
        )},
        "KDE Plasma's wallpapers that are photographs (one of them grey); left out: the renders and paintings "
        "(Altai, Autumn, Canopee, Cascade, Cluster, Elarun, Flow, FlyingKonqui, Honeywave, IceCold, Kay, Kokkini, "
        "MilkyWay, Opal, PastelHills, Patak, SafeLanding, Shell, Volna)",
    ),
    # The confirmation set of fine-tuning's teacher weight (issue 56): built only once 0.25 was chosen on the others.
    "lxqt": PhotoSet(
        "lxqt-themes", "1.2.0-1",
        {Path(name).stem.lower(): f"usr/share/lxqt/wallpapers/{name}" for name in (
            "Butterfly-Kenneth-Wimer.jpg", "Valendas.png", "after-the-rain.jpg", "appleflower.png", "beam.png",
            "butterfly.png", "cloud.png", "drop.png", "flowers.png", "fog.jpg", "this-is-not-windows.jpg",
        )},
        "LXQt's wallpapers that are photographs: a butterfly, mountains, clouds, blossom, a drop on grass, flowers, "
        "fog over fields (CC BY-SA 3.0, the package's wallpapers/License); left out: the drawings and renders "
        "(kde-plasma, lxqt-origami-green, origami-*, plasma-logo-*, plasma_arch, simple_blue_widescreen, "
        "triangles*, waves-*)",
    ),
    # The confirmation set of issue 56's choice on lxqt and mate-nature drawn at each seed (teacher_quality.py
    # --photo-set): defined before that choice, run only after it.
    "kphotoalbum": PhotoSet(
        "kphotoalbum", "5.9.1-1",
        {name: f"usr/share/kphotoalbum/demo/{name}.jpg" for name in (
            "anne_helene", "bar55", "blackie", "cold_water", "donna", "grand_canyon_1", "jesper", "new_wave_1", "pool",
            "qt-logo", "skagen", "snow", "spiff", "sunset", "wayne",
        )},
        "KPhotoAlbum's demo album, snapshots of 400-800 px: people, pets, a pool table, a canyon, the sea, snow, a "
        "sunset (qt-logo is a photograph of three people); one photograph of each subject, the first, its others "
        "left out (bar55_2, donna_2, grand_canyon_2/3, jesper_2, new_wave_2, pool_2, skagen_2, spiff_2) and the "
        "thumbnails of CategoryImages/",
    ),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS), metavar="NAME",
                        help=f"of: {', '.join(SETS)} (default: all)")
    parser.add_argument("--out", type=Path, default=Path("data/photo_sets"))
    parser.add_argument("--seed", type=int, default=0, help="draws the patches, the held-out blocks and the grey ones")
    parser.add_argument("--tiny", action="store_true", help="2 photos of the first set, 3 train + 1 val patches each")
    return parser.parse_args()


def unpacked(photo_set: PhotoSet, scratch: Path) -> Path:
    """The package's files under `scratch`, from the Debian archive (apt verifies the download)."""
    spec = f"{photo_set.package}={photo_set.version}"
    try:
        subprocess.run(["apt-get", "download", spec], cwd=scratch, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit("photo_sets: needs Debian's apt-get and dpkg-deb (the photographs come from Debian packages)")
    except subprocess.CalledProcessError as error:
        hint = " (apt's package lists may be missing or old: run apt-get update)" if "locate" in error.stderr else ""
        raise SystemExit(f"photo_sets: apt-get download {spec} failed: {error.stderr.strip()}{hint}")
    (deb,) = scratch.glob(f"{photo_set.package}_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(scratch / "root")], check=True)
    return scratch / "root"


def build(name: str, out: Path, seed: int, tiny: bool) -> dict:
    """The set's tree under out/name (replaced if there) and its description, also written to out/name.json."""
    photo_set = SETS[name]
    chosen = dict(list(photo_set.photos.items())[:2]) if tiny else photo_set.photos
    settings = PhotosSource(train_per_class=3, val_per_class=1) if tiny else PhotosSource()
    tree = out / name
    shutil.rmtree(tree, ignore_errors=True)
    with tempfile.TemporaryDirectory() as scratch:
        root = unpacked(photo_set, Path(scratch))
        files = {label: root / path for label, path in chosen.items()}

        def photos():
            for label, path in files.items():
                with Image.open(path) as opened:
                    # One of lxqt's is RGBA (opaque): patches are written grey (L) or colour (RGB).
                    yield label, np.asarray(opened if opened.mode in ("L", "RGB") else opened.convert("RGB"))

        write_patches(tree, photos(), settings, seed, grey_share=GREY_SHARE)
        digests = {label: hashlib.sha256(path.read_bytes()).hexdigest() for label, path in files.items()}
    counts = {split: len(list((tree / split).rglob("*.png"))) for split in ("train", "val")}
    grey = sum(Image.open(path).mode == "L" for path in tree.rglob("*.png"))
    description = {
        "set": name, "package": photo_set.package, "version": photo_set.version, "about": photo_set.about,
        "photos": {label: {"path": chosen[label], "sha256": digest} for label, digest in digests.items()},
        "seed": seed, "patches": settings.model_dump(), "grey_share": GREY_SHARE, "images": counts, "grey": grey,
    }
    (out / f"{name}.json").write_text(json.dumps(description, indent=1) + "\n")
    return description


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.sets[:1] if args.tiny else args.sets
    print("| set | package | classes | train / val patches | grey |\n| --- | --- | --- | --- | --- |")
    for name in names:
        built = build(name, args.out, args.seed, args.tiny)
        print(f"| {name} | {built['package']} {built['version']} | {len(built['photos'])} | "
              f"{built['images']['train']} / {built['images']['val']} | {built['grey']} |", flush=True)


if __name__ == "__main__":
    main()
