"""The wide retention suite's needles, written in each kind of document's own shape.

Per kind (quality/texts.py WIDE_KINDS) and question kind: the needle line, the question,
the answer's opening words and the value's shape. The shapes match the surroundings on
purpose (a 5-digit bug number among Debian bug numbers, a port among ports, a version among
versions, a city where a time-zone table names cities): issue 45's lost answers were numbers
inside number-dense prose, which a needle that stands out as prose would not test.
Placeholders: {k} a key word (a name), {kl} the same lower-cased, {n} the needle's noun (one
per depth), {p} / {pl} a person (the multikey questions' keys, one template for all of them),
{v} the value asked for, {x} and {lat} other fresh numbers of the line, {cc} a
country-code-like pair, {area} a time-zone area, {ts} a timestamp taken from the log itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple


class Template(NamedTuple):
    needle: str
    question: str
    prefix: str  # the answer's opening words, decoded before the value
    shape: str  # a key of SHAPES
    nouns: tuple[str, ...] = ()  # {n}: one per depth, so that no two needles of a context read alike


# key before value in every line, and one noun per depth: with one template at five depths, or
# the key after the value (a table row's comment), SmolLM2 with full attention answered 16% of
# a first draft's questions (it copied one needle, or a real value of the same shape, for all)
TEMPLATES: dict[str, dict[str, Template]] = {
    "relnotes": {
        "number": Template(" * The {k} {n} now defaults to {v}, up from the old value.",
                           "What does the {k} {n} default to now?", "The {k} {n} now defaults to", "n5",
                           ("pack limit", "fetch timeout", "delta window", "index cache size", "retry budget")),
        "version": Template(" * The {k} {n} now needs version {v} or newer.",
                            "Which version does the {k} {n} need?", "The {k} {n} needs version", "version",
                            ("helper", "backend", "credential daemon", "merge driver", "remote helper")),
        "name": Template(" * The {k} {n} has moved to {v}, and the old host redirects there.",
                         "Where has the {k} {n} moved?", "The {k} {n} has moved to", "city",
                         ("mirror", "build farm", "test lab", "archive", "release server")),
        "multikey": Template(" * The fix sent by {p} was merged as change {v}.",
                             "As which change was the fix sent by {p} merged?",
                             "The fix sent by {p} was merged as change", "n4"),
    },
    "debchangelog": {
        "number": Template("  * Fix the {k} {n} (Closes: #{v})", "Which bug does the fix of the {k} {n} close?",
                           "The fix of the {k} {n} closes bug #", "n5",
                           ("crash at startup", "memory leak", "race on exit", "buffer overflow", "locale bug")),
        "version": Template("  * Update the {k} {n} to upstream version {v}.",
                            "To which upstream version was the {k} {n} updated?",
                            "The {k} {n} was updated to upstream version", "version",
                            ("patch", "test suite", "man page", "symbols file", "build script")),
        "name": Template("  * Add the {k} {n} for {v}.", "For which city was the {k} {n} added?",
                         "The {k} {n} was added for", "city",
                         ("time zone", "locale", "mirror entry", "holiday table", "keyboard map")),
        "multikey": Template("  * Apply the patch sent by {p}. (Closes: #{v})",
                             "Which bug does the patch sent by {p} close?",
                             "The patch sent by {p} closes bug #", "n4"),
    },
    "services": {
        "number": Template("{kl}-{n}\t\t{v}/tcp", "Which port does {kl}-{n} use?", "{kl}-{n} uses port", "port",
                           ("relay", "proxy", "backup", "metrics", "gateway")),
        "version": Template("{kl}-{n}\t{x}/udp\t\t\t# {k} {n} protocol version {v}",
                            "Which protocol version does the {k} {n} use?",
                            "The {k} {n} protocol version is", "version",
                            ("rpc", "sync", "feed", "notify", "lookup")),
        "name": Template("{kl}-{n}\t{x}/tcp\t\t\t# {k} {n}, hosted in {v}", "Where is the {k} {n} hosted?",
                         "The {k} {n} is hosted in", "city",
                         ("archive", "mirror", "tracker", "console", "ledger")),
        "multikey": Template("{pl}-game\t{v}/udp", "Which port does {pl}-game use?", "{pl}-game uses port", "n4"),
    },
    "zones": {
        "number": Template("{cc}\t+{lat}+{x}\tEurope/{k}\t{k} {n}, longitude {v}",
                           "What is the longitude of the {k} {n}?", "The longitude of the {k} {n} is", "longitude",
                           ("district", "islands", "valley", "coast", "highlands")),
        "version": Template("# {k} {n} as of release {v}", "As of which release are the {k} {n}?",
                            "The {k} {n} are as of release", "version",
                            ("district boundaries", "coordinates", "country codes", "zone names", "comments")),
        "name": Template("{cc}\t+{lat}+{x}\t{k} {n}: {area}/{v}", "Which city names the time zone of the {k} {n}?",
                         "The time zone of the {k} {n} is {area}/", "city",
                         ("region", "province", "territory", "county", "prefecture")),
        "multikey": Template("{cc}\t-{lat}+{x}\tAntarctica/{p}\t{p} station, elevation {v} m",
                             "What is the elevation of {p} station?", "The elevation of {p} station is", "n4"),
    },
    "dpkglog": {
        "number": Template("{ts} startup {kl}-{n} pid {v}", "What pid did {kl}-{n} start with?",
                           "{kl}-{n} started with pid", "n5", ("daemon", "agent", "monitor", "worker", "scheduler")),
        "version": Template("{ts} install {kl}-{n}:amd64 <none> {v}-1", "Which version of {kl}-{n} was installed?",
                            "The version of {kl}-{n} installed was", "version", ("tools", "utils", "dev", "doc", "bin")),
        "name": Template("{ts} status installed {kl}-{n}-{v}:all 1.4-2", "Which city is the installed {kl}-{n} for?",
                         "The installed {kl}-{n} is for", "city", ("locale", "tzdata", "mirror", "keymap", "fonts")),
        "multikey": Template("{ts} status installed {pl}-build:amd64 {v}", "Which build of {pl}-build was installed?",
                             "The build of {pl}-build installed was", "n4"),
    },
}

# cities are drawn from this pool minus those the document already names (a time-zone table
# names most capitals), so that the needle is the only place the answer appears
CITIES = ("Lisbon", "Nairobi", "Oslo", "Kyoto", "Denver", "Lima", "Dublin", "Hanoi", "Cairo", "Prague",
          "Seattle", "Manila", "Zurich", "Havana", "Perth", "Montreal", "Bogota", "Helsinki", "Tunis",
          "Osaka", "Glasgow", "Santiago", "Warsaw", "Mumbai", "Quito", "Vienna", "Porto", "Geneva", "Lyon",
          "Valencia", "Krakow", "Bergen", "Malmo", "Turin", "Seville", "Hamburg", "Munich", "Milan",
          "Naples", "Florence", "Marseille", "Antwerp", "Rotterdam", "Leeds", "Cork", "Basel", "Graz",
          "Bordeaux", "Toulouse", "Gdansk", "Tartu", "Kaunas", "Plovdiv", "Split", "Ghent", "Utrecht",
          "Aarhus", "Tampere", "Uppsala", "Nagoya", "Sapporo", "Busan", "Pune", "Cusco", "Curitiba")


def _digits(n: int) -> Callable[[random.Random], str]:
    return lambda rng: str(rng.randrange(10 ** (n - 1), 10 ** n))


SHAPES: dict[str, Callable[[random.Random], str]] = {
    "n4": _digits(4),
    "n5": _digits(5),
    "port": lambda rng: str(rng.randrange(10000, 65536)),
    "longitude": lambda rng: f"{rng.randrange(0, 180):03d}{rng.randrange(0, 60):02d}",
    "version": lambda rng: f"{rng.randint(1, 9)}.{rng.randint(10, 49)}.{rng.randint(1, 9)}",
    "city": lambda rng: rng.choice(CITIES),
}
