// kvcascade extension ops: releasing the GIL around blocking work, safely at interpreter exit.
//
// The fs tier runs its compiled movers on daemon threads, and a thread abandoned at a job's
// deadline (stuck in open() or read()) may return while the interpreter is finalizing. CPython
// before 3.14 then ends that thread with pthread_exit() from inside PyEval_RestoreThread; with
// pybind11::gil_scoped_release that call sits in a destructor, and the forced unwind leaving a
// noexcept destructor is std::terminate: the whole process aborted at exit ("terminate called
// without an active exception", rc 134). kvc::GilRelease parks such a thread instead (the process
// is exiting; the thread ends with it) and never reacquires the GIL after finalization began.
// The main thread, which runs the finalization, always reacquires it (CPython lets it).

#ifndef KVCASCADE_KVC_GIL_H_
#define KVCASCADE_KVC_GIL_H_

#include <Python.h>
#include <unistd.h>

namespace kvc {

// threading.main_thread().ident, set by record_main_thread() when the module is imported.
inline unsigned long main_thread_ident = 0;

// Call once at import, with the GIL held.
inline void record_main_thread() {
  PyObject* threading = PyImport_ImportModule("threading");
  PyObject* main = threading ? PyObject_CallMethod(threading, "main_thread", nullptr) : nullptr;
  PyObject* ident = main ? PyObject_GetAttrString(main, "ident") : nullptr;
  if (ident != nullptr) main_thread_ident = PyLong_AsUnsignedLong(ident);
  Py_XDECREF(ident);
  Py_XDECREF(main);
  Py_XDECREF(threading);
  PyErr_Clear();
}

// True for a thread other than the main one once the interpreter is finalizing: CPython would
// end it in PyEval_RestoreThread.
inline bool must_not_return_to_python() {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing() != 0;
#else
  const bool finalizing = _Py_IsFinalizing() != 0;
#endif
  return finalizing && PyThread_get_thread_ident() != main_thread_ident;
}

// Releases the GIL for its scope (same use as pybind11::gil_scoped_release).
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  ~GilRelease() {
    while (must_not_return_to_python()) pause();
    PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace kvc

#endif  // KVCASCADE_KVC_GIL_H_
