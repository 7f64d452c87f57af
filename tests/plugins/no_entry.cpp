// A shared library without flowrun's entry point: loading it must fail with a clear message.
extern "C" int not_a_flowrun_plugin() { return 42; }
