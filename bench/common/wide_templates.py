"""The wide retention suite's needles, written in each kind of document's own shape.

Per kind (bench/common/texts.py WIDE_KINDS) and question kind: the needle line, the question,
the answer's opening words and the value's shape. The shapes match the surroundings on
purpose (a 5-digit bug number among Debian bug numbers, a port among ports, a version among
versions, a city where a time-zone table names cities): issue 45's lost answers were numbers
inside number-dense prose, which a needle that stands out as prose would not test.
Placeholders: {k} a key word (a name), {kl} the same lower-cased, {p} / {pl} a person (the
multikey questions' keys, one template for all of them), {v} the value asked for, {x} and
{lat} other fresh numbers of the line, {cc} a country-code-like pair, {area} a time-zone area,
{ts} a timestamp taken from the log itself.
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


TEMPLATES: dict[str, dict[str, Template]] = {
    "relnotes": {
        "number": Template(" * The {k} limit now defaults to {v} entries, up from the old value.",
                           "What does the {k} limit default to now?", "The {k} limit now defaults to", "n5"),
        "version": Template(" * The {k} helper now needs version {v} or newer of its library.",
                            "Which version does the {k} helper need?", "The {k} helper needs version", "version"),
        "name": Template(" * The {k} mirror has moved to {v}, and the old host redirects there.",
                         "Where has the {k} mirror moved?", "The {k} mirror has moved to", "city"),
        "multikey": Template(" * The fix sent by {p} was merged as change {v}.",
                             "As which change was the fix sent by {p} merged?",
                             "The fix sent by {p} was merged as change", "n4"),
    },
    "debchangelog": {
        "number": Template("  * Fix the {k} crash at startup. (Closes: #{v})",
                           "Which bug does the fix of the {k} crash close?",
                           "The fix of the {k} crash closes bug #", "n5"),
        "version": Template("  * Update the {k} patch to upstream version {v}.",
                            "To which upstream version was the {k} patch updated?",
                            "The {k} patch was updated to upstream version", "version"),
        "name": Template("  * Add the {k} time zone for {v}.", "For which city was the {k} time zone added?",
                         "The {k} time zone was added for", "city"),
        "multikey": Template("  * Apply the patch sent by {p}. (Closes: #{v})",
                             "Which bug does the patch sent by {p} close?",
                             "The patch sent by {p} closes bug #", "n4"),
    },
    "services": {
        "number": Template("{kl}\t\t{v}/tcp\t\t\t# {k} relay service", "Which port does the {k} relay service use?",
                           "The {k} relay service uses port", "port"),
        "version": Template("{kl}-rpc\t{x}/udp\t\t\t# {k} RPC, protocol version {v}",
                            "Which protocol version does the {k} RPC use?",
                            "The {k} RPC uses protocol version", "version"),
        "name": Template("{kl}-sync\t{x}/tcp\t\t\t# {k} sync, hosted in {v}", "Where is the {k} sync hosted?",
                         "The {k} sync is hosted in", "city"),
        "multikey": Template("{pl}\t\t{v}/udp\t\t\t# {p}'s game server", "Which port does {p}'s game server use?",
                             "{p}'s game server uses port", "n4"),
    },
    "zones": {
        "number": Template("{cc}\t+{lat}+{v}\tEurope/{k}", "What is the longitude in the row of Europe/{k}?",
                           "The longitude in the row of Europe/{k} is +", "longitude"),
        "version": Template("# {k} district boundaries as of release {v}",
                            "As of which release are the {k} district boundaries?",
                            "The {k} district boundaries are as of release", "version"),
        "name": Template("{cc}\t+{lat}+{x}\t{area}/{v}\t{k} region", "Which city names the time zone of the {k} region?",
                         "The time zone of the {k} region is {area}/", "city"),
        "multikey": Template("{cc}\t-{lat}+{x}\tAntarctica/{p}\t{p} station, elevation {v} m",
                             "What is the elevation of {p} station?", "The elevation of {p} station is", "n4"),
    },
    "dpkglog": {
        "number": Template("{ts} startup {kl}-daemon pid {v}", "What pid did {kl}-daemon start with?",
                           "{kl}-daemon started with pid", "n5"),
        "version": Template("{ts} install {kl}-tools:amd64 <none> {v}-1", "Which version of {kl}-tools was installed?",
                            "The version of {kl}-tools installed was", "version"),
        "name": Template("{ts} status installed {kl}-locale-{v}:all 1.4-2",
                         "Which city is the installed {kl}-locale for?", "The installed {kl}-locale is for", "citylow"),
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
    "citylow": lambda rng: rng.choice(CITIES).lower(),
}
