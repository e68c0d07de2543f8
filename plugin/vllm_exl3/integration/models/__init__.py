"""Model classes the plugin registers over vLLM's own, one module per architecture whose vLLM class cannot hold an
EXL3 pack as it is (each module says why). Each is vLLM's class underneath and behaves as it unless the model is
served with `quantization: exl3`. integration/register.py registers them lazily (`module:class`): a module here
imports vLLM's model module, so only vLLM's registry imports it, when it resolves that architecture."""
