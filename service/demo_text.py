"""The demo's bundled context: a short handbook the demo question can only be answered from."""

TEXT = """\
The Lighthouse Keepers' Handbook of Port Averel

Port Averel is a small harbour town on a rocky northern coast. Its lighthouse, the Averel Light,
stands on a granite spur called the Needle, one mile north of the harbour mouth. The light was
first lit in 1851 and was converted from oil to electricity in 1932.

Duties. The keeper on watch climbs the tower at sunset, checks the lamp, winds the clockwork
that turns the lens, and writes the weather in the log every four hours. In fog, the keeper
sounds the horn twice every thirty seconds. Ships approaching from the east must keep the light
on their port side until they see the green buoy at the harbour mouth.

The lens. The Averel Light uses a second-order Fresnel lens made in Paris. It flashes white
three times every fifteen seconds, and the beam can be seen twenty-two nautical miles away in
clear weather. The lens weighs about two tonnes and floats on a bath of mercury so that it
turns with almost no friction.

Supplies. A supply boat named the Marguerite visits the Needle every second Tuesday. It brings
fresh water, food, lamp spares and mail. In winter storms the boat may be delayed for a week,
so the store room always keeps three weeks of food and water.

The keepers. The longest-serving keeper was Ada Penhallow, who kept the light for thirty-one
years, from 1902 to 1933. She kept a cat named Biscuit, and her log entries are kept in the
town museum. The light has been automatic since 1987, but a volunteer still visits it every
month to clean the lens and check the batteries.
"""

# one fact, stated once in the text: SmolLM2-135M names Ada from the cached context in both decode
# modes (asked "Who was the longest-serving keeper of the Averel Light?", full attention, the
# CPU's default since --decode-mode auto, answered "the keeper of the Light of the North"; asked
# two facts at once it answered "every 15 seconds" and named no keeper)
QUESTION = "Which keeper had a cat named Biscuit?"
