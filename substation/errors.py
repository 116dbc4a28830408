"""The exceptions Substation raises on bad input; one base class so callers can catch them all."""


class SubstationError(Exception):
    """Base of every error Substation raises on purpose."""


class SizeError(SubstationError, ValueError):
    """A problem size is malformed: unknown preset, non-positive dim, I != H*P, ..."""


class LayoutError(SubstationError, ValueError):
    """A layout names dims the tensor does not have, or a configuration misses or adds tensors."""


class GraphError(SubstationError, ValueError):
    """An unknown operator or tensor name, or an inconsistent graph definition."""


class RecordError(SubstationError, ValueError):
    """A profile file or row is malformed; the message names the file, line and column."""


class InputError(SubstationError, ValueError):
    """A tensor handed to the Encoder has the wrong shape or values."""


class UnsupportedError(SubstationError, ValueError):
    """A model or a call asks for what an Encoder does not compute (attention probabilities, cross-attention, a
    key/value cache, head masks, a mask that is not a key-padding mask); the message names the layer."""


class DeviceError(SubstationError, RuntimeError):
    """The GPU path was asked for where there is no GPU, or a GPU-only package is missing."""


class SelectionError(SubstationError, ValueError):
    """The optimizer cannot choose a configuration: a profile without candidates for some operators, an
    unknown split variable, or no solution within the solver's time limit."""


class InfeasibleError(SelectionError):
    """No configuration satisfies the layout constraints; the message names the conflicting tensors."""


class ConfigurationFileError(SubstationError, ValueError):
    """A layout configuration file (pickle or JSON twin) is corrupt, truncated, of another format version,
    or does not fit the graph, size or dtype asked for; the message names the field."""
