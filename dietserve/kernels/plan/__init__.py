"""What tuning consumes and produces, as data: the micro-kernel (``microkernel``), the kernel plan
file (``kernel_plan``), the decision tree over shape expressions inside it (``decision_tree``) and
the tuning task file the compiler hands the tuner (``task_file``). Pure Python, no TVM: the server
reads plans and trees where only TVM's runtime is installed."""
